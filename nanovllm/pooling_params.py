"""What a pooling model (runner="pooling") and its requests may ask for, with vLLM's names,
validated on construction: the engine's `PoolerConfig` (how a prompt's hidden states become one
vector) and each request's `PoolingParams` (Matryoshka `dimensions`, a `normalize` override).

Messages start with the field's name, as SamplingParams' do (the server reports it as `param`).
"""

from dataclasses import dataclass, fields

RUNNERS = ("auto", "generate", "pooling")
# LAST: the prompt's last token's final hidden state (decoder embedders such as Qwen3-Embedding);
# MEAN: the average over every prompt token; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolerConfig:
    """How a pooling model pools; a field left None takes the checkpoint's sentence-transformers
    setting, else the default (LAST, normalize=True: what Qwen3-Embedding uses)."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self):
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if self.normalize not in (None, True, False):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def of(cls, value: "PoolerConfig | dict | None") -> "PoolerConfig":
        """The config `LLM(pooler_config=...)` or `--pooler-config` gave: a PoolerConfig, a dict
        of its fields, or None."""
        if value is None or isinstance(value, PoolerConfig):
            return value or cls()
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a dict or a PoolerConfig, got {type(value).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"pooler_config has unknown fields {unknown}; allowed: {', '.join(sorted(allowed))}")
        return cls(**value)

    @property
    def reads_every_position(self) -> bool:
        """MEAN and CLS read positions before the last: a prefix-cache hit must not skip them."""
        return self.pooling_type != "LAST"

    def over(self, defaults: "PoolerConfig") -> "PoolerConfig":
        """This config with its unset fields taken from `defaults`."""
        return PoolerConfig(self.pooling_type if self.pooling_type is not None else defaults.pooling_type,
                            self.normalize if self.normalize is not None else defaults.normalize)


DEFAULT_POOLER_CONFIG = PoolerConfig(pooling_type="LAST", normalize=True)


@dataclass
class PoolingParams:
    """One embedding request's settings: `dimensions` keeps the first N values of the vector
    (Matryoshka), before normalising; `normalize` None takes the model's PoolerConfig."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.normalize not in (None, True, False):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    def check_against_model(self, hidden_size: int) -> None:
        """Raise ValueError where the model's vectors cannot give what was asked for."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions must be at most the model's embedding size {hidden_size}, "
                             f"got {self.dimensions}")
