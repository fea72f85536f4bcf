"""``resolve_profile(spec)``: what ``Pipeline.from_pretrained(..., deploy_profile=spec)`` applies, and the presets.

``spec`` is ``"auto"`` (plan everything for this machine), a preset name (``list_presets()``, YAML files in
``omnilab/presets``), a deploy YAML path or mapping (:mod:`omnilab.profiles.deploy_yaml`), or a
``DeployProfile``. May import the rest of ``omnilab.profiles`` (it is the package's top).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

from omnilab.errors import ConfigError
from omnilab.hardware import probe_hardware
from omnilab.profiles.deploy_yaml import is_complete, doc_notes, load_yaml_doc, values_from_doc
from omnilab.profiles.overrides import Overrides
from omnilab.profiles.planner import plan
from omnilab.profiles.profile import DeployProfile

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def profile_from_yaml(source: Any) -> DeployProfile:
    """A complete profile from YAML (path, text or mapping): ``DeployProfile.from_yaml``."""
    return DeployProfile.from_yaml(source)


def resolve_profile(spec: Any = "auto", *, hardware=None, model_config=None, env: Mapping[str, str] | None = None,
                    **plan_kwargs: Any) -> DeployProfile:
    """What ``Pipeline.from_pretrained(..., deploy_profile=spec)`` applies.

    ``spec``: ``"auto"`` (plan everything), a preset name (``list_presets()``), a YAML path, or a
    ``DeployProfile``. A complete file with no ``OMNILAB_*`` variable set loads as written; otherwise its
    values become planner defaults. The result is checked against ``hardware`` (probed if None).
    """
    hw = hardware or probe_hardware()
    env = os.environ if env is None else env
    if isinstance(spec, DeployProfile):
        return dataclasses.replace(spec, warnings=tuple(spec.check(hw)))
    if spec is None or spec == "auto":
        return plan(hw, model_config, env=env, **plan_kwargs)
    if isinstance(spec, str) and spec in list_presets():
        path, source, name = PRESET_DIR / f"{spec}.yaml", f"preset {spec}", spec
    elif isinstance(spec, (str, os.PathLike)) and Path(spec).is_file():
        path, source, name = Path(spec), f"file {spec}", Path(spec).stem
    elif isinstance(spec, Mapping):
        path, source, name = spec, "mapping", str(spec.get("name") or "custom")
    else:
        raise ConfigError(f"unknown deploy profile {spec!r}: not 'auto', not a preset ({', '.join(list_presets())}) "
                          f"and not an existing YAML file")
    doc, label = load_yaml_doc(path)
    values = values_from_doc(doc, label)
    replans = {k for k, v in plan_kwargs.items() if k != "path_times"}  # a timing only informs an open dtype
    if is_complete(doc, values) and not Overrides(env).env_set() and not replans:
        profile = profile_from_yaml(doc if isinstance(path, Mapping) else path)
        return dataclasses.replace(profile, name=name, warnings=tuple(profile.check(hw)) + doc_notes(doc, label))
    profile = plan(hw, model_config, defaults=values, defaults_source=source, env=env,
                   name=str(doc.get("name") or name), **plan_kwargs)
    return dataclasses.replace(profile, warnings=profile.warnings + doc_notes(doc, label))
