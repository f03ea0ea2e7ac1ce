"""What counts as hocompile's own code while tracing: the whole package, whichever folder a module is in.

Four capture modules tell hocompile's frames and files from the user's: ``id(p)`` answers the
stand-in's own id to hocompile and the real param's to the user (stand_ins.real_id), a refusal
names the user's line (scalars.user_line, host_reads.step_line), and the warm-start key lists the
user's files the step ran (executed_files). Each once meant "this file's folder", which after the
package was laid out by stage (capture/, runtime/, ops/, ...) was capture/ alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import hocompile
from hocompile.capture.executed_files import ExecutedFiles
from hocompile.capture.host_reads import step_line
from hocompile.capture.scalars import user_line
from hocompile.capture.stand_ins import real_id

PACKAGE = os.path.dirname(os.path.abspath(hocompile.__file__))
# A module of hocompile outside capture/ (the runtime calls the step; ops run inside it).
OURS = os.path.join(PACKAGE, "runtime", "compiled_optimizer.py")


def _run_as(filename: str, source: str, **names: Any) -> dict[str, Any]:
    """Run ``source`` as if it were code of ``filename`` (its frames carry that file name)."""
    scope = dict(names)
    exec(compile(source, filename, "exec"), scope)
    return scope


def test_ids_asked_by_any_hocompile_module_are_the_stand_ins_own() -> None:
    stand_in, real = torch.zeros(2), torch.zeros(2)
    traced_id = real_id({id(stand_in): real}, id)
    assert _run_as(OURS, "got = traced_id(x)", traced_id=traced_id, x=stand_in)["got"] == id(stand_in)
    assert _run_as(os.path.join(PACKAGE, "ops", "x.py"), "got = traced_id(x)", traced_id=traced_id,
                   x=stand_in)["got"] == id(stand_in)
    assert _run_as(__file__, "got = traced_id(x)", traced_id=traced_id, x=stand_in)["got"] == id(real)


def test_a_refusal_names_the_users_line_not_a_hocompile_one() -> None:
    # the user's step calls into hocompile/runtime (e.g. a registered op), which asks where it is
    inner = _run_as(OURS, "def where():\n    return user_line(), step_line()\n",
                    user_line=user_line, step_line=step_line)["where"]
    here, read_here = inner()  # this line is the user's
    assert here.startswith(f" at {__file__}:") and "inner()" in here, here
    assert "inner()" in read_here and "test_own_frames.py" in read_here, read_here


def test_hocompiles_own_files_are_not_the_users() -> None:
    def user() -> None:
        pass

    ours = _run_as(OURS, "def ours():\n    return None\n")["ours"]
    with ExecutedFiles() as seen:
        user()
        ours()
    files = seen.files()
    assert __file__ in files
    assert not [f for f in files if f.startswith(PACKAGE)], files


def test_a_sibling_whose_name_starts_the_same_is_the_users() -> None:
    """``hocompile_train.py`` beside the package, ``torchao/`` beside torch: the user's code, not ours."""
    stand_in, real = torch.zeros(2), torch.zeros(2)
    traced_id = real_id({id(stand_in): real}, id)
    for sibling in (PACKAGE + "_train.py", os.path.dirname(torch.__file__) + "ao/optim.py"):
        assert _run_as(sibling, "got = traced_id(x)", traced_id=traced_id, x=stand_in)["got"] == id(real), sibling
        where = _run_as(sibling, "def where():\n    return user_line()\n", user_line=user_line)["where"]()
        assert where.startswith(f" at {sibling}:"), where
