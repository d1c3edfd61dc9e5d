"""What a function lowers to for the GPU, read on a machine without one: JAX lowers for CUDA from
the CPU (`lower(lowering_platforms=("cuda",))`), and the StableHLO module says whether anything in
it would make XLA:GPU wait on the host (a conditional or a while loop reads its predicate there)."""

from __future__ import annotations

from typing import Any


def stablehlo_ops(module: Any) -> list[Any]:
    """Every operation of a StableHLO module (`Lowered.compiler_ir("stablehlo")`), nested ones included."""
    ops: list[Any] = []

    def walk(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    ops.append(inner.operation)
                    walk(inner.operation)

    walk(module.operation)
    return ops


def host_syncs(module: Any) -> list[str]:
    """The ops of `module` that make XLA:GPU read a predicate on the host: whiles, ifs, and cases
    whose index is not a constant (lax.platform_dependent's pick of a strategy has a constant
    index, or a single branch, and XLA folds it away)."""
    found = []
    for op in stablehlo_ops(module):
        if op.name in ("stablehlo.while", "stablehlo.if"):
            found.append(op.name)
        elif op.name == "stablehlo.case" and len(op.regions) > 1 and op.operands[0].owner.name != "stablehlo.constant":
            found.append(op.name)
    return found
