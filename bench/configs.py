"""Model shapes the benchmark sweeps, and the parsing of the token list."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TOKENS = tuple(2**i for i in range(15))  # 1 .. 16384


@dataclass(frozen=True)
class Config:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: tuple[int, ...] = DEFAULT_TOKENS


CONFIGS = {c.name: c for c in (
    Config("tiny", 256, 128, 16, 4, tuple(2**i for i in range(9))),  # the CPU default: 1 .. 256 tokens
    # Qwen3-MoE scaled down to the CPU (the shape of ../shared/FACTS.md's CPU baselines)
    Config("qwen3-cpu", 1024, 384, 64, 8, (1, 4, 16, 64, 256, 1024, 2048)),
    Config("qwen3-30b-a3b", 2048, 768, 128, 8),
    Config("mixtral-8x7b", 4096, 14336, 8, 2),
    Config("deepseek-v3", 7168, 2048, 256, 8),
    Config("gpt-oss-20b", 2880, 2880, 32, 4),
)}


def get_configs(text: str) -> list[Config]:
    """Comma-separated config names ("all" for every one)."""
    names = list(CONFIGS) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"--config: expected names from {sorted(CONFIGS)} (comma-separated) or 'all', got {text!r}")
    return [CONFIGS[n] for n in names]


def parse_tokens(text: str) -> tuple[int, ...]:
    """"1,64,4096" -> (1, 64, 4096): positive, de-duplicated, sorted."""
    try:
        tokens = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--tokens: expected comma-separated positive integers, got {text!r}") from None
    if not tokens or tokens[0] < 1:
        raise ValueError(f"--tokens: expected comma-separated positive integers, got {text!r}")
    return tuple(tokens)
