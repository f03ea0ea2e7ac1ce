"""compile_optimizer's surface: four keywords most users set, ``options=`` for the rest (the same names
as keywords), one place that holds the names (Settings.resolve), and no import-time side effects."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
import torch

import hocompile
from hocompile import Settings

COMMON = ("backend", "precision", "fallback", "cache_dir")


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)


def test_few_keywords_and_options_by_name(cache_dir) -> None:
    keywords = [p for p in inspect.signature(hocompile.compile_optimizer).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in keywords] == [*COMMON, "options"]
    by_options = hocompile.compile_optimizer(_sgd(), cache_dir=cache_dir, options={"verify": 2, "self_check": False})
    by_keywords = hocompile.compile_optimizer(_sgd(), cache_dir=cache_dir, verify=2, self_check=False)
    assert by_options._settings == by_keywords._settings
    assert (by_options._settings.verify, by_options._settings.self_check) == (2, False)


def test_an_option_given_twice_or_unknown_is_refused_by_name(cache_dir) -> None:
    with pytest.raises(TypeError, match="'verify' both in options= and as a keyword"):
        hocompile.compile_optimizer(_sgd(), cache_dir=cache_dir, options={"verify": 1}, verify=2)
    with pytest.raises(TypeError, match="unknown option 'verfy' \\(did you mean 'verify'\\?\\)"):
        hocompile.compile_optimizer(_sgd(), cache_dir=cache_dir, verfy=1)
    with pytest.raises(TypeError, match="takes 'backend' as a keyword of its own, not in options="):
        hocompile.compile_optimizer(_sgd(), cache_dir=cache_dir, options={"backend": "aten"})


def test_every_option_is_documented_once_in_the_docstring() -> None:
    doc = hocompile.compile_optimizer.__doc__ or ""
    options = doc[doc.index("Options ("):]
    for name in inspect.signature(Settings.resolve).parameters:
        assert re.search(rf"^        (\w+, )*{name}\b[,:]", options, re.M), name


def test_importing_hocompile_registers_nothing_with_dynamo() -> None:
    """The Dynamo backend comes from the package's entry point when torch.compile first asks for it."""
    code = ("import hocompile, torch\n"
            "from torch._dynamo.backends.registry import _COMPILER_FNS\n"
            "assert 'hocompile' not in _COMPILER_FNS\n"
            "print(torch.compile(lambda x: x * 2, backend='hocompile')(torch.ones(2)).tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[2.0, 2.0]", out.stderr[-2000:]
