"""The Triton IR inside a lowered Pallas-Triton program: op counts (tests) and module text (the
CPU compile of benchmarks/triton_compile.py).

A lowered `pallas_call` of the Triton dialect is a custom call whose `ir` attribute holds the
kernel's Triton-dialect MLIR module as bytecode. Reading it back needs the Triton dialect
registered in an MLIR context, which only jaxlib's private extension `_triton_ext` offers (no
public JAX API exposes the kernel IR, and the triton wheel's own parser rejects jaxlib's bytecode:
"missing BytecodeOpInterface for arith.divsi"); this module is the one place that imports it.
"""
from __future__ import annotations

import collections
import dataclasses
import re

from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs import _triton_ext

_IR_ATTR = re.compile(r'ir = "((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass
class OpCounts:
    total: collections.Counter      # op name -> count in the kernel
    in_loop: collections.Counter    # op name -> count inside an scf.for / scf.while body

    def __repr__(self):
        keep = ("tt.dot", "tt.load", "tt.store", "scf.for")
        return f"OpCounts({ {k: self.total[k] for k in keep} }, in loop: tt.dot=" \
               f"{self.in_loop['tt.dot']})"


def _bytecode(escaped: str) -> bytes:
    """The bytes of an MLIR string attribute printed with \\XX escapes."""
    raw = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: "\\x" + m.group(1), escaped)
    return raw.encode("latin1").decode("unicode_escape").encode("latin1")


_PARAMS = re.compile(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


def kernel_texts(lowered_text: str) -> dict[str, tuple[str, int, int]]:
    """{kernel name: (Triton-dialect MLIR text, num_warps, num_stages)} of every Triton kernel
    in a lowered module's text (the launch parameters sit beside the IR in the custom call)."""
    out = {}
    for m in _IR_ATTR.finditer(lowered_text):
        p = _PARAMS.search(lowered_text, m.end())
        with ir.Context() as ctx:
            _triton_ext.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            text = ir.Module.parse(_bytecode(m.group(1))).operation.get_asm(
                enable_debug_info=False)
        out[p.group(1)] = (text, int(p.group(3)), int(p.group(2)))
    return out


def kernel_ops(lowered_text: str) -> dict[str, OpCounts]:
    """{kernel name (tt.func sym_name): OpCounts} of every Triton kernel in a lowered module's
    text (jax.jit(f).trace(...).lower(lowering_platforms=("cuda",)).as_text())."""
    out = {}
    for m in _IR_ATTR.finditer(lowered_text):
        with ir.Context() as ctx:
            _triton_ext.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            module = ir.Module.parse(_bytecode(m.group(1)))
            total, in_loop, names = collections.Counter(), collections.Counter(), []

            def walk(op, depth):
                total[op.name] += 1
                if depth:
                    in_loop[op.name] += 1
                if op.name == "tt.func":
                    names.append(ir.StringAttr(op.attributes["sym_name"]).value)
                inner = depth + (op.name in ("scf.for", "scf.while"))
                for region in op.regions:
                    for block in region.blocks:
                        for child in block.operations:
                            walk(child.operation, inner)

            walk(module.operation, 0)
        (name,) = names
        out[name] = OpCounts(total, in_loop)
    return out
