"""FusionPass: the peephole rewrites Mul(Silu(x), y) -> SwiGLU(x, y) and
Mul(Gelu(x), y) -> GeGLU(x, y).

Runs after backend assignment, because a rewrite is only made where the mul's
backend says it has the fused kernel. The folded Silu becomes a dead node (no
buffer, never executed). The CUDA decode fusions (q|k|v, gate|up + SwiGLU, ...) are
not IR rewrites: its executor merges plan steps.
"""

from __future__ import annotations

from minfer.graph.ir import ComputeGraph, Op


# activation op -> (the backend's name for the fused kernel, the fused op)
_FOLDS = {Op.Silu: ("swiglu", Op.SwiGLU), Op.Gelu: ("geglu", Op.GeGLU)}


class FusionPass:
    def run(self, graph: ComputeGraph, entries_by_id: dict) -> int:
        """Rewrite in place; returns the number of rewrites."""
        cons = graph.consumers()
        outputs = set(graph.outputs)
        count = 0
        for node in graph.nodes:
            if node.op is not Op.Mul or node.id in graph.dead or node.backend is None:
                continue
            entry = entries_by_id.get(node.backend)
            if entry is None:
                continue
            a, b = node.src
            for gate_side, other in ((a, b), (b, a)):
                s = graph.nodes[gate_side]
                fused = _FOLDS.get(s.op)
                # The activation must feed only this mul (its value is dropped) and be live.
                if (fused is not None and entry.supports_fused(fused[0]) and gate_side != other
                        and gate_side not in graph.dead and gate_side not in outputs and cons[gate_side] == [node.id]):
                    x = s.src[0]
                    node.op = fused[1]
                    node.src = [x, other]
                    graph.dead.add(gate_side)
                    cons[x] = [node.id if c == gate_side else c for c in cons[x]]
                    count += 1
                    break
        return count
