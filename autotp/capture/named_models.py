"""Models named on the command line.

    hf:<model_type>        transformers' model for that type, from its config class defaults
                           (hf:llama is a 7B shape, hf:gpt2 is GPT-2 small)
    path/to/checkpoint     a directory holding an HF config.json (weights are not read)
    file.py:factory        a function returning a model, or (model, example_args[, kwargs])
    package.module:factory the same, importable

``--set key=value`` overrides config fields (hf: and directories) or is passed to the factory
as a keyword. Models are built on the meta device unless real weights are asked for.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from autotp.errors import ConfigError


@dataclass
class LoadedModel:
    model: nn.Module
    example_args: Optional[tuple] = None
    example_kwargs: Optional[dict] = None
    name: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)

    def cast(self, dtype: Optional[str]) -> "LoadedModel":
        """The model and the floating tensors of its example in ``dtype`` (as they are where
        None); returns itself."""
        if dtype is None:
            return self
        to = getattr(torch, dtype)
        self.model.to(to)

        def convert(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(to)
            return value

        if self.example_args is not None:
            self.example_args = tuple(convert(v) for v in self.example_args)
        if self.example_kwargs is not None:
            self.example_kwargs = {k: convert(v) for k, v in self.example_kwargs.items()}
        return self


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set takes key=value, got {item!r}")
        try:
            value: Any = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        out[key.strip()] = value
    return out


def known_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # optional
    from transformers.models.auto.modeling_auto import (  # optional: transformers
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    return sorted(t for t in CONFIG_MAPPING_NAMES
                  if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or t in MODEL_MAPPING_NAMES)


def _quiet_transformers() -> Any:
    try:
        import transformers  # optional: transformers
    except ImportError:
        raise ConfigError("hf: models need the transformers package: pip install "
                          "transformers") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _build_hf(config: Any, meta: bool) -> nn.Module:
    transformers = _quiet_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # optional

    auto = (transformers.AutoModelForCausalLM
            if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else transformers.AutoModel)
    if meta:
        with torch.device("meta"):
            return auto.from_config(config)
    return auto.from_config(config)


def _apply(config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConfigError(f"{type(config).__name__} has no field {key!r} (from --set)")
        setattr(config, key, value)


def load_model(spec: str, overrides: Optional[dict[str, Any]] = None, *, meta: bool = True,
               seed: int = 0) -> LoadedModel:
    overrides = dict(overrides or {})
    torch.manual_seed(seed)
    if spec.startswith("hf:"):
        model_type = spec[3:]
        transformers = _quiet_transformers()
        known = known_model_types()
        if model_type not in known:
            raise ConfigError(f"unknown model type {model_type!r} for hf:; known types: "
                              + ", ".join(known))
        config = transformers.AutoConfig.for_model(model_type)
        _apply(config, overrides)
        return LoadedModel(_build_hf(config, meta), name=spec, overrides=overrides)
    if os.path.isdir(spec):
        if not os.path.exists(os.path.join(spec, "config.json")):
            raise ConfigError(f"{spec} is a directory without a config.json")
        transformers = _quiet_transformers()
        config = transformers.AutoConfig.from_pretrained(spec, local_files_only=True)
        _apply(config, overrides)
        return LoadedModel(_build_hf(config, meta), name=spec, overrides=overrides)
    if ":" in spec:
        return _load_factory(spec, overrides, meta)
    raise ConfigError(
        f"cannot read the model {spec!r}: use hf:<model_type> (e.g. hf:llama), a directory "
        "with a config.json, or path/to/file.py:factory / package.module:factory"
    )


def _load_factory(spec: str, overrides: dict[str, Any], meta: bool) -> LoadedModel:
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        if not os.path.exists(target):
            raise ConfigError(f"no such file: {target}")
        name = "autotp_user_" + os.path.splitext(os.path.basename(target))[0]
        module_spec = importlib.util.spec_from_file_location(name, target)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        directory = os.path.dirname(os.path.abspath(target))
        if directory not in sys.path:
            sys.path.insert(0, directory)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"cannot import {target!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"{target} has no callable {attr!r}")
    if meta:
        with torch.device("meta"):
            result = factory(**overrides)
    else:
        result = factory(**overrides)
    args = kwargs = None
    if isinstance(result, tuple):
        if not result:
            raise ConfigError(f"{spec} returned an empty tuple, expected a model")
        model, *rest = result
        if rest:
            args = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        if len(rest) > 1:
            kwargs = rest[1]
    else:
        model = result
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return LoadedModel(model, args, kwargs, name=spec, overrides=overrides)
