"""Fleet configuration: one settings object (env prefix ``FLEET_``) and TOML launch profiles."""

from config.launch_profile import LaunchProfile, load_profile
from config.settings import Settings, load_settings

__all__ = ["LaunchProfile", "Settings", "load_profile", "load_settings"]
