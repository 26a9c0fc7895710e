"""Fleet configuration: one settings object (``config.settings``, env prefix ``FLEET_``) and
TOML launch profiles (``config.launch_profile``, files under ``config/profiles/``).

Nothing is imported here, so a command pays only for the module it uses.
"""
