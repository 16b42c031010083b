"""Compiles kernel launches for NVIDIA targets in a process of its own: ``python triton_compile.py DEPTH IN OUT``
(``ahead_of_time.compile_all`` starts it). Cases (JSON, from ``ahead_of_time.launches``) in, results out.

A process of its own because ``@triton.jit`` reads ``TRITON_INTERPRET`` when the kernels' module is imported (the
suite interprets); it loads ``triton_kernels.py`` by its path, so that neither torch nor the package is imported
(a few seconds per process). The arguments are typed and specialised as Triton's launcher specialises those of a
real launch: pointers 16-byte aligned (torch's allocations), and the integers it specialises (those not in a
kernel's ``do_not_specialize``) divisible by 16 where a launch's are: the head dimension and the strides of
rows, tokens and heads, all multiples of the head dimension; head counts and group sizes as not (most models').
"""

import contextlib
import importlib.util
import io
import json
import os
import re
import sys

# pointers that are not the inputs' dtype
POINTER_TYPES = {"VALID": "*i8", "OBSERVED": "*i8", "SLOT_HEAD": "*i64", "LSE": "*fp32", "SCORES": "*fp32",
                 "PART_MAX": "*fp32", "PART_SUM": "*fp32", "PART_OUTPUT": "*fp32", "LOGITS": "*fp32",
                 "KC": "*u8", "VC": "*u8", "KS": "*fp16", "KM": "*fp16", "VS": "*fp16", "VM": "*fp16"}


def compile_case(kernels, case: dict) -> dict:
    """One case compiled for its target: its shared bytes (and, through ptxas, registers and spills), or the error."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = getattr(kernels, case["kernel"])
    signature, attributes = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in case["constexprs"]:
            signature[name] = "constexpr"
        elif name.isupper():
            signature[name] = POINTER_TYPES.get(name, "*" + case["dtype"])
            attributes[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
            if (name == "head_dim" or name.startswith("stride")) and index not in kernel.do_not_specialize:
                attributes[(index,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=case["constexprs"],
                                       attrs=attributes)
    options = dict(num_warps=case["warps"], num_stages=case["stages"])
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # ptxas's report, where asked for
            compiled = triton.compile(source, target=GPUTarget("cuda", case["target"], 32), options=options)
    except Allocated as allocated:
        return dict(shared=allocated.shared)
    except Exception as error:  # noqa: BLE001 - reported with its case
        return dict(error=f"{type(error).__name__}: {error}"[:2000])
    return dict(shared=compiled.metadata.shared, **ptxas_resources(log.getvalue()))


def ptxas_resources(log: str) -> dict[str, int]:
    """Registers and spills from ptxas's ``-v`` report."""
    found = {}
    for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads")):
        match = re.search(pattern, log)
        if match:
            found[key] = int(match.group(1))
    return found


class Allocated(Exception):
    """Raised once the shared memory is allocated: the rest of the pipeline is not needed for its bytes."""

    def __init__(self, shared: int):
        super().__init__(shared)
        self.shared = shared


def stop_once_allocated(backend, stages, options, language, capability) -> None:
    """Replaces the LLVM stage by its passes up to the shared-memory allocation (Triton 3.6's ``make_llir``)."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    def allocate(module, metadata):
        manager = ir.pass_manager(module.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(manager)
        passes.ttgpuir.add_allocate_warp_groups(manager)
        passes.convert.add_scf_to_cf(manager)
        passes.gluon.add_inliner(manager)
        ptx_version = get_ptx_version_from_options(options, backend.target.arch)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(manager, capability, ptx_version)
        manager.run(module, "kvcompress.allocate")
        raise Allocated(module.get_int_attr("ttg.shared"))

    stages["llir"] = allocate


def main(depth: str, cases_path: str, results_path: str) -> None:
    from triton import knobs

    if depth == "shared":
        knobs.runtime.add_stages_inspection_hook = stop_once_allocated
    else:
        knobs.nvidia.dump_ptxas_log = True
    location = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_kernels.py")
    spec = importlib.util.spec_from_file_location("kvcompress_triton_kernels", location)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    with open(cases_path) as cases:
        results = [compile_case(kernels, case) for case in json.load(cases)]
    with open(results_path, "w") as written:
        json.dump(results, written)


if __name__ == "__main__":
    main(*sys.argv[1:])
