"""One place for each thing (issues 35 and 44): the fleet's Redis layout (every key name and
every Lua script in workers/redisdb/), one token-checked key, the node keys, a batch's units,
and no dead helpers beside them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import redis

from workers.batch import runner
from workers.dataset import sink_lock
from workers.delivery import ownership
from workers.node import context
from workers.redisdb import scripts
from workers.redisdb.keys import NodeKeys

ROOT = Path(__file__).resolve().parents[1]
REDIS_MODULE = ROOT / "workers" / "redisdb"
LUA = REDIS_MODULE / "lua"
# Lua text, a script sent or registered by hand, a key literal of the fleet's namespace.
OUTSIDE_RULES = {
    "Lua text": re.compile(r"redis\.p?call\(|\bKEYS\[|\bARGV\["),
    "a script call": re.compile(r"\.eval\(|\bregister_script\b|\bevalsha\b|\bscript_load\b"),
    "a fleet: key literal": re.compile(r"""(?<![\w"'])[rbfuRBFU]{0,2}["']fleet:"""),
}


def _sources_outside_the_redis_module() -> list[Path]:
    files = []
    for top in ("workers", "producer", "bench", "deploy", "tools", "config"):
        files += [p for p in (ROOT / top).rglob("*.py") if REDIS_MODULE not in p.parents]
    return files


def test_no_lua_script_call_or_key_literal_outside_the_redis_module():
    found = []
    for path in _sources_outside_the_redis_module():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()}"
                      for what, rule in OUTSIDE_RULES.items() if rule.search(line)]
    assert not found, "\n".join(found)


def test_the_rules_see_what_they_forbid():
    lines = ["r.eval(SCRIPT, 1, k)", "r.register_script(text)", "key = f'fleet:job:{j}'",
             "x = \"fleet:janitor\"", "if redis.call('GET', KEYS[1]) == ARGV[1] then"]
    assert all(any(rule.search(x) for rule in OUTSIDE_RULES.values()) for x in lines)
    assert not any(rule.search("field metadata ``fleet: json``, x-fleet: &fleet")
                   for rule in OUTSIDE_RULES.values())


def _body(path: Path) -> str:
    """A script's code without its comments and blank lines."""
    return "\n".join(x.strip() for x in path.read_text().splitlines()
                     if x.strip() and not x.strip().startswith("--"))


def test_every_script_is_one_file_used_by_one_named_call_and_none_is_written_twice():
    files = sorted(LUA.glob("*.lua"))
    names = {p.stem for p in files}
    called = set(re.findall(r'_run\(r, "(\w+)"', (REDIS_MODULE / "scripts.py").read_text()))
    assert called == names
    bodies = [_body(p) for p in files]
    assert len(set(bodies)) == len(bodies), "two scripts say the same"
    for name in names:  # every helper a script names is there
        assert "redis.call" in scripts.source(name)


def test_a_script_is_loaded_once_and_then_run_by_its_digest_from_any_client(r: redis.Redis):
    r.script_flush()
    r.config_resetstat()
    other = redis.Redis(port=r.connection_pool.connection_kwargs["port"])
    for client in (r, other, r):
        assert scripts.release_if_owner(client, "k", "t") == 0
    pipe = other.pipeline()
    scripts.release_if_owner(pipe, "k", "t")
    assert pipe.execute() == [0]
    calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
    assert calls.get("cmdstat_script|load") == 1 and "cmdstat_eval" not in calls
    other.close()


def test_the_scripts_ship_in_the_wheel():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["workers.redisdb"]
    assert "lua/*.lua" in globs and "lua/lib/*.lua" in globs


def test_batch_ownership_and_the_data_set_lock_share_one_lock_implementation():
    for module in (ownership, sink_lock):
        text = Path(module.__file__).read_text()
        assert "scripts.release_if_owner(" in text
        assert "scripts.take_or_keep(" in text


def test_the_shared_take_or_keep_script_honours_the_blocking_set(r: redis.Redis):
    def take(*args):
        return scripts.take_or_keep(r, *args)

    assert take("k", "me", 5000) == 1 and take("k", "you", 5000) == 0
    assert scripts.release_if_owner(r, "k", "you") == 0 and r.get("k") == b"me"
    assert scripts.release_if_owner(r, "k", "me") == 1 and r.get("k") is None
    r.sadd("done", "3")  # a done batch is not taken again by a lapsed claim
    assert take("k", "me", 5000, ("done", "3")) == 0 and r.get("k") is None
    assert take("k", "me", 5000, ("done", "4")) == 1


def test_node_keys_live_in_the_redis_layout_and_dead_helpers_are_gone():
    assert NodeKeys("gpu0@h").handback == "fleet:node:gpu0@h:handback"
    assert not hasattr(runner, "handback_key") and not hasattr(runner, "units_of")
    assert not hasattr(context, "gpu_from_queues")


def test_the_delivery_and_split_packages_name_each_of_their_modules():
    for package in ("delivery", "split"):
        folder = ROOT / "workers" / package
        doc = (folder / "__init__.py").read_text()
        missing = [p.stem for p in folder.glob("*.py")
                   if p.stem != "__init__" and f"``{p.stem}``" not in doc]
        assert not missing, f"workers/{package}/__init__.py does not name {missing}"
