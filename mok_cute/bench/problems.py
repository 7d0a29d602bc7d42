"""Random problems of a shape: normal data (never zeros), weights scaled by fan-in so that
activations stay O(1), K distinct experts per token drawn uniformly."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from mok_cute.shapes import Shape, moe_flops


@dataclass
class Inputs:
    x: torch.Tensor  # [T, H] bf16
    topk_idx: torch.Tensor  # [T, K] int32, global expert ids
    topk_weights: torch.Tensor  # [T, K] fp32


@dataclass
class Problem:
    shape: Shape
    inputs: Inputs
    w_gate: torch.Tensor  # [E, I, H]
    w_up: torch.Tensor  # [E, I, H]
    w_down: torch.Tensor  # [E, H, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    seed: int = 0

    @property
    def tokens(self) -> int:
        return int(self.inputs.x.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.w_gate.shape[0])

    @property
    def flops(self) -> float:
        return moe_flops(self.tokens, self.shape.hidden, self.shape.intermediate, self.shape.top_k, self.shared is not None)

    @property
    def routed_rows(self) -> int:
        return self.tokens * self.shape.top_k

    def with_fresh_inputs(self, tokens: int, seed: int) -> "Problem":
        """Same weights, new random tokens and routing."""
        gen = torch.Generator(device=self.w_gate.device).manual_seed(seed)
        inputs = random_inputs(tokens, self.shape.hidden, self.num_experts, self.shape.top_k, self.w_gate.device, gen)
        return replace(self, inputs=inputs, seed=seed)

    def virtual(self, ranks: int, inputs: Inputs | None = None) -> "VirtualInputs":
        return VirtualInputs.split(self, ranks, inputs)


@dataclass
class VirtualInputs:
    """A problem split over R emulated ranks (views, plus the shared expert replicated per rank)."""

    x: torch.Tensor  # [R, T/R, H]
    topk_idx: torch.Tensor  # [R, T/R, K] global ids
    topk_weights: torch.Tensor
    w_gate: torch.Tensor  # [R, E/R, I, H]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [R, E/R, H, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @staticmethod
    def split(problem: Problem, ranks: int, inputs: Inputs | None = None, shared_rep=None) -> "VirtualInputs":
        inputs = inputs or problem.inputs
        t, e = inputs.x.shape[0], problem.num_experts
        if ranks <= 0 or t % ranks or e % ranks:
            raise ValueError(f"ranks: expected a divisor of both T={t} and E={e}, got {ranks}")
        if shared_rep is None and problem.shared is not None:
            shared_rep = tuple(w.unsqueeze(0).expand(ranks, *w.shape).contiguous() for w in problem.shared)
        return VirtualInputs(
            x=inputs.x.view(ranks, t // ranks, -1),
            topk_idx=inputs.topk_idx.view(ranks, t // ranks, -1),
            topk_weights=inputs.topk_weights.view(ranks, t // ranks, -1),
            w_gate=problem.w_gate.view(ranks, e // ranks, *problem.w_gate.shape[1:]),
            w_up=problem.w_up.view(ranks, e // ranks, *problem.w_up.shape[1:]),
            w_down=problem.w_down.view(ranks, e // ranks, *problem.w_down.shape[1:]),
            shared=shared_rep,
        )


def random_inputs(tokens: int, hidden: int, experts: int, top_k: int, device: Any, gen: torch.Generator) -> Inputs:
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    # K distinct experts per token, uniformly at random.
    topk_idx = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    topk_weights = torch.softmax(torch.randn(tokens, top_k, device=device, generator=gen), dim=1)
    return Inputs(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous())


def randn_weight(shape: Sequence[int], fan_in: int, device: Any, gen: torch.Generator) -> torch.Tensor:
    """A bf16 weight of normal values over sqrt(fan_in)."""
    w = torch.empty(*shape, dtype=torch.bfloat16, device=device)
    # Fill expert by expert so the fp32 temporary stays small for big shapes.
    flat = w.view(-1, shape[-1]) if len(shape) > 1 else w.view(1, -1)
    rows = max(1, (1 << 26) // shape[-1])
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start : start + rows]
        chunk.copy_(torch.randn(chunk.shape, device=device, generator=gen) * fan_in**-0.5)
    return w


def make_problem(
    shape: Shape,
    device: Any = "cuda",
    seed: int = 0,
    t_scale: float = 1.0,
    ranks: int = 1,
    tokens: int | None = None,
) -> Problem:
    """Random normal problem for ``shape``; ``tokens`` overrides the total token count."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w_gate = randn_weight((e, i, h), h, device, gen)
    w_up = randn_weight((e, i, h), h, device, gen)
    w_down = randn_weight((e, h, i), i, device, gen)
    shared = None
    if shape.shared:
        shared = (randn_weight((i, h), h, device, gen), randn_weight((i, h), h, device, gen), randn_weight((h, i), i, device, gen))
    t = tokens if tokens is not None else shape.total_tokens(t_scale, ranks)
    inputs = random_inputs(t, h, e, shape.top_k, device, gen)
    return Problem(shape, inputs, w_gate, w_up, w_down, shared, seed)
