"""Runs SGLang's serving benchmark client (`sglang.bench_serving`) in this process,
for a test that starts it as a child (importing sglang in the test process breaks the
Triton interpreter).

The client's module imports one constant, FAKE_BOOTSTRAP_HOST, from
`sglang.srt.disaggregation.utils`, whose imports reach SGLang's model configs and
torchvision; torchvision has no wheel for a CPU torch. That one module is given here
with the constant (the value SGLang's own module has), and nothing else changes:
the request functions, the dataset and the result JSON are SGLang's.

    python tests/serve/sglang_bench.py --backend sglang-oai --base-url URL ...
"""

from __future__ import annotations

import runpy
import sys
import types


def main() -> None:
    stand_in = types.ModuleType("sglang.srt.disaggregation.utils")
    stand_in.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]
    sys.modules[stand_in.__name__] = stand_in
    sys.argv = ["sglang.bench_serving", *sys.argv[1:]]
    runpy.run_module("sglang.bench_serving", run_name="__main__")


if __name__ == "__main__":
    main()
