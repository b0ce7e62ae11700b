"""The ops the benchmark runner measures, by name (`--op`)."""

from hybrax.bench.workloads import attention, attention_decode, context_parallel, gla, kda, kda_decode, kda_layer
from hybrax.bench.workloads.base import MODES, Call, Declined, Work, Workload

WORKLOADS: dict[str, Workload] = {
    workload.op: workload
    for workload in (kda.WORKLOAD, gla.WORKLOAD, attention.WORKLOAD, kda_decode.WORKLOAD, attention_decode.WORKLOAD,
                     *context_parallel.WORKLOADS, *kda_layer.WORKLOADS)
}

__all__ = ["MODES", "WORKLOADS", "Call", "Declined", "Work", "Workload"]
