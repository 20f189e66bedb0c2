"""How fast can this machine go, and how fast can the big ones? The numbers behind lesson 00.

probe      measured: this machine's matmul FLOP/s (fp32, bf16, fp16), read and copy bandwidth, any kernel
peak       this CPU's datasheet peak (cores x clock x FLOP/cycle/core) and the best matmul of a size sweep
specs      cited: peak FLOP/s, memory, bandwidth and interconnect of V100, A100, H100, TPU v4/v5e/v5p, IPU GC200
rounds     several benchmarks timed in rounds (each once per round), so that drift hits them all alike
roofline   modelled: FLOPs and bytes of matmul, softmax, LayerNorm, attention; min(peak, I * B)
cost       what training costs: 6ND FLOPs, days on a chip at a given MFU, chips to hold the state

>>> from llmedu import hardware
>>> hardware.matmul(4096, 4096, 4096).intensity > hardware.accelerator("H100 SXM").ridge_point
True
"""

from .cost import (
    ADAM_MIXED_PRECISION_BYTES_PER_PARAM,
    GPT3_PARAMS,
    GPT3_TOKENS,
    chips_to_hold,
    training_days,
    training_flops,
)
from .peak import MatmulPeak, PeakSpec, PeakUnknown, best_matmul_peak, datasheet_peak
from .probe import (
    DTYPES,
    Measurement,
    cache_sizes,
    default_nbytes,
    last_level_cache_bytes,
    machine_summary,
    measure_bandwidth,
    measure_kernel,
    measure_machine,
    measure_matmul_flops,
    measure_read_bandwidth,
)
from .roofline import (
    Workload,
    arithmetic_intensity,
    attainable_flops,
    attention,
    bound,
    layernorm,
    matmul,
    matmul_flops,
    ridge_point,
    softmax,
)
from .rounds import Benchmark, benchmark, matmul_benchmark, measure_in_rounds
from .specs import ACCELERATORS, Accelerator, accelerator, interconnect_table, si, spec_table

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "accelerator",
    "si",
    "spec_table",
    "interconnect_table",
    "DTYPES",
    "Measurement",
    "cache_sizes",
    "default_nbytes",
    "last_level_cache_bytes",
    "machine_summary",
    "measure_bandwidth",
    "measure_kernel",
    "measure_machine",
    "measure_matmul_flops",
    "measure_read_bandwidth",
    "Benchmark",
    "benchmark",
    "matmul_benchmark",
    "measure_in_rounds",
    "MatmulPeak",
    "PeakSpec",
    "PeakUnknown",
    "best_matmul_peak",
    "datasheet_peak",
    "Workload",
    "arithmetic_intensity",
    "attainable_flops",
    "attention",
    "bound",
    "layernorm",
    "matmul",
    "matmul_flops",
    "ridge_point",
    "softmax",
    "ADAM_MIXED_PRECISION_BYTES_PER_PARAM",
    "GPT3_PARAMS",
    "GPT3_TOKENS",
    "chips_to_hold",
    "training_days",
    "training_flops",
]
