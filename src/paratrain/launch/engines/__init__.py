"""The engines of `paratrain launch --backend ...`: one package per engine."""
