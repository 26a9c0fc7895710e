"""The fleet's Redis layout: every key name (``keys``) and every Lua script (``lua/``, one file
per script, called by name through ``scripts``). No other module spells a key of the fleet's
namespace or sends a script; tests/test_one_place.py holds that."""
