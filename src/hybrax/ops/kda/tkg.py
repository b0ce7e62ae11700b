"""Placeholder until kda_tkg lands (issue 4)."""


def kda_tkg(*args, **kwargs):
    raise NotImplementedError("kda_tkg")
