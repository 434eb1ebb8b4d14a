"""One module per experiment; importing this package registers them all (run order:
:attr:`~layernorm.experiments.engine.registry.Experiment.order`)."""

from . import (  # noqa: F401
    adanorm_study,
    char_lm,
    convnet,
    draw,
    gain_init,
    geometry,
    invariances,
    longer_than_train,
    mnist_ff,
    seq_mnist,
    spoken_digits,
)
