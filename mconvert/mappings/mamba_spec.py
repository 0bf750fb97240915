"""The Mamba-2 mixer of hybrid models (Nemotron-H), as megatron-core's MambaMixer builds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MambaSpec:
    """Mamba-2 mixers of `num_heads` heads of `head_dim` channels, whose B and C fall in `num_groups` groups of
    `state_dim`. megatron-core fixes the rest (a 4-tap convolution with a bias, chunks of 128, silu, the gated
    RMSNorm after the gate with epsilon 1e-5 over groups of inner / num_groups channels, no projection biases)."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_dim: int

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    def in_proj_sections(self) -> tuple[tuple[str, int], ...]:
        """The rows of the fused input projection, in order: the gate z, the input x, B, C, and one dt per head."""
        groups = self.num_groups * self.state_dim
        return (("z", self.inner), ("x", self.inner), ("B", groups), ("C", groups), ("dt", self.num_heads))

    def conv_sections(self) -> tuple[tuple[str, int], ...]:
        """The channels of the causal convolution, in order: x, B, C."""
        return self.in_proj_sections()[1:4]
