"""Adversarial round 15 (issue 21): regression tests for what the fifteenth independent round
found.

Found, before, now:

* A config's ``plugins`` module (or a ``module:callable`` model's module), allowed with
  ``--allow-code``, that raises at import, or registers a component with options that are not a
  frozen dataclass, was a traceback; a relative or path-like name (``../x``) was a TypeError
  traceback. An installed entry-point plugin that fails to load was a traceback from every
  command. Now one line naming the module (:func:`partialfl.registry.import_module`).
"""

from __future__ import annotations

import pytest
from test_adversarial import _run

LS = """plugins = [{plugins}]
[problem]
name = "least-squares"
num_clients = 4
n = 40
d_theta = 3
d_w = 2
[method]
algorithm = "ffgg"
[personalize]
rounds = 2
clients_per_round = 2
client = {{ name = "cg", tau = 2 }}
"""

_PLUGINS = {
    "raises": ("raise RuntimeError('boom at import')\n", "failed at import: RuntimeError: boom"),
    "bad_options": ("from partialfl.registry import register\nclass O: pass\n"
                    "@register('algorithm', 'adv15-evil', options=O)\ndef b(o, c): return None\n",
                    "options must be a frozen dataclass"),
}


@pytest.mark.parametrize("kind", sorted(_PLUGINS))
@pytest.mark.parametrize("where", ["plugins", "model"])
def test_a_plugin_failing_at_import_is_one_line(tmp_path, capsys, monkeypatch, kind, where):
    code, says = _PLUGINS[kind]
    mod = f"adv15_{kind}_{where}"
    (tmp_path / f"{mod}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    if where == "plugins":
        text = LS.format(plugins=f'"{mod}"')
    else:
        text = f'[model]\nname = "{mod}:f"\n[method]\nalgorithm = "ffgg"\n'
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    rc, err = _run(["train", cfg, "--out", tmp_path / "o", "--no-progress", "--dry-run",
                    "--allow-code"], capsys)
    assert rc == 2 and len(err) == 1 and mod in err[0] and says in err[0], err


@pytest.mark.parametrize("name", ["../x", "", "a..b", "/etc/x", ".rel"])
def test_a_plugin_name_that_is_not_a_module_name_is_one_line(tmp_path, capsys, name):
    cfg = tmp_path / "c.toml"
    cfg.write_text(LS.format(plugins=f'"{name}"'))
    rc, err = _run(["run", cfg, "--out", tmp_path / "o", "--no-progress", "--dry-run",
                    "--allow-code"], capsys)
    assert rc == 2 and len(err) == 1 and "is not a module name" in err[0], err


def test_an_installed_plugin_failing_to_load_is_one_line(monkeypatch):
    import importlib.metadata

    from partialfl import registry
    from partialfl.config import ConfigError

    ep = importlib.metadata.EntryPoint("broken", "adv15_no_such_module_xyz", "partialfl.plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [ep] if group == registry.PLUGIN_GROUP else [])
    monkeypatch.setattr(registry, "_PLUGINS_LOADED", False)
    with pytest.raises(ConfigError, match="installed plugin 'broken'.*failed to load"):
        registry.names("algorithm")
