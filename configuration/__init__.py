from .configuration_disentangled import DisentangledConfig

__all__ = ["DisentangledConfig"]
