"""Every Triton launch the wrappers can make, compiled ahead of time on CPU for each NVIDIA architecture
(``kvcompress.kernels.ahead_of_time``), and its shared memory held to the architecture's per-block limit.

The other kernel tests run the kernels under Triton's interpreter, which has no shared memory: a block table that
outgrows a GPU's would only fail at the first launch there. Compiled: each kernel at every architecture, dtype
(bfloat16, float16, float32) and head dimension (64, 128, 256) with the blocks the table gives that device, at its
widest flags (every flag that adds a tile on, the decode step's largest block of query heads; without codes and
reading 8-bit codes); on one entry, every combination of flags, to show the widest needs the most. The compiles
stop once Triton has allocated the shared memory, a shortcut held equal to the whole pipeline's bytes (through
ptxas) on two launches.
"""

import pytest
import torch

pytest.importorskip("triton.backends.nvidia", reason="the kernels need Triton's NVIDIA backend")
from kvcompress.kernels import ahead_of_time, triton_blocks  # noqa: E402

EVERY_FLAG_ENTRY = ((9, 0), torch.bfloat16, 128)  # the largest tiles


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[tuple[dict, dict]]]:
    """The widest launches of every table entry on every architecture and the every-flag launches of one,
    compiled in one go."""
    widest = ahead_of_time.widest_launches()
    capability, dtype, head_dim = EVERY_FLAG_ENTRY
    every_flag = ahead_of_time.for_target(ahead_of_time.launches(dtype, head_dim, every_flag=True), capability)
    results = ahead_of_time.compile_all(widest + every_flag)
    return dict(widest=list(zip(widest, results[:len(widest)])),
                every_flag=list(zip(every_flag, results[len(widest):])))


def test_every_launch_fits_its_architecture(compiled):
    failures = []
    for case, result in compiled["widest"]:
        limit = triton_blocks.shared_memory(divmod(case["target"], 10))
        if "error" in result or result["shared"] > limit:
            failures.append(f"sm_{case['target']} {case['kernel']} {case['dtype']} {case['constexprs']} "
                            f"warps={case['warps']} stages={case['stages']}: "
                            f"{result.get('error') or result['shared']} B > {limit} B")
    # per architecture and head dimension: the four kernels with codes, and the half-precision forward without
    assert len(compiled["widest"]) == 6 * 3 * (5 + 5 + 4)
    assert not failures, "\n".join(failures)


def test_the_widest_flags_need_the_most(compiled):
    widest = {}
    for case, result in compiled["widest"]:
        if ((divmod(case["target"], 10), case["dtype"], case["constexprs"]["BLOCK_D"])
                == (EVERY_FLAG_ENTRY[0], "bf16", EVERY_FLAG_ENTRY[2])):
            widest[case["kernel"]] = max(widest.get(case["kernel"], 0), result["shared"])
    assert len(compiled["every_flag"]) == (8 + 8 + 4) * 3 + 1  # 16, 8 and 4 bits
    for case, result in compiled["every_flag"]:
        assert result["shared"] <= widest[case["kernel"]], case


def test_the_shortcut_allocates_what_the_whole_pipeline_does():
    cases = (ahead_of_time.for_target(ahead_of_time.launches(torch.bfloat16, 128)[:1], (9, 0))
             + ahead_of_time.for_target(ahead_of_time.launches(torch.float32, 64)[2:3], (8, 6)))
    shortcut = ahead_of_time.compile_all(cases)
    whole = ahead_of_time.compile_all(cases, depth="cubin")
    assert [result["shared"] for result in shortcut] == [result["shared"] for result in whole]
    assert all(result["registers"] > 0 for result in whole)
