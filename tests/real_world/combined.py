"""Two ways training code glues a Muon and an AdamW into "one optimizer".

``CombinedOptimizer`` is *not* a ``torch.optim.Optimizer``: a thin object that
owns both and steps them in turn, exposing their ``param_groups`` for LR
schedules (downstream nanochat training code; modded-nanogpt's
``optimizers = [adam, muon]`` loop made an object).

``TrainerCombinedOptimizer`` *is* one, because HuggingFace's Trainer wants a
single ``Optimizer``: it is constructed over the *same* group dicts as the two
it owns (so schedulers reach both), keeps an unused ``state`` of its own, and
its ``step`` delegates. The Muon inside is Keller Jordan's ``SingleDeviceMuon``.
"""

from __future__ import annotations

from typing import Any

import torch


class CombinedOptimizer:
    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.optimizers = [muon, adamw]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict[str, Any]]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, state_dicts: list[dict[str, Any]]) -> None:
        for opt, sd in zip(self.optimizers, state_dicts):
            opt.load_state_dict(sd)


class TrainerCombinedOptimizer(torch.optim.Optimizer):
    def __init__(self, *, muon: torch.optim.Optimizer, aux: torch.optim.Optimizer) -> None:
        self.muon, self.aux = muon, aux
        # The very group dicts of both: an LR scheduler built on this object drives them.
        super().__init__([*muon.param_groups, *aux.param_groups], defaults={})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.aux.step()
        return loss
