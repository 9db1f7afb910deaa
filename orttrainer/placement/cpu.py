"""What this machine's CPU can do, read once from /proc/cpuinfo: its model and the flags that decide
which matrix kernels are fastest here (docs/performance.md, "Matmul kernels").

    facts().model          "AMD EPYC ..." ("" where /proc/cpuinfo cannot be read)
    bf16_units()           ("avx512_bf16",): the bfloat16 matrix flags this CPU has, () when none
    identity()             a short digest of model + flags: what a per-host measurement is keyed by
"""

import dataclasses
import functools
import hashlib
import re

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # bfloat16 dot products in hardware (oneDNN uses either)


@dataclasses.dataclass(frozen=True)
class CpuFacts:
    model: str
    vendor: str
    flags: frozenset


@functools.lru_cache(maxsize=None)
def facts(path="/proc/cpuinfo") -> CpuFacts:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return CpuFacts(model=model.group(1).strip() if model else "", vendor=vendor.group(1) if vendor else "",
                    flags=frozenset(flags.group(1).split()) if flags else frozenset())


def bf16_units(cpu: CpuFacts | None = None):
    """The flags of BF16_FLAGS that this CPU has, in that order."""
    flags = (cpu or facts()).flags
    return tuple(f for f in BF16_FLAGS if f in flags)


def identity(cpu: CpuFacts | None = None) -> str:
    cpu = cpu or facts()
    text = "\n".join([cpu.vendor, cpu.model, " ".join(sorted(cpu.flags))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
