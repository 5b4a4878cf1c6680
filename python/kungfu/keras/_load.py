"""kungfu.keras.load_model: resume distributed training from a model saved with model.save()."""


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True, strategy="ssgd", **wrapper_kwargs):
    """keras.models.load_model(filepath, ...), with the restored optimizer made distributed.

    The saved optimizer comes back as its plain Keras class, with its state (step count, learning rate,
    slots). It is wrapped by kungfu.optimizers.DistributedOptimizer(optimizer, strategy,
    **wrapper_kwargs), which keeps that state, and the model is compiled again with the wrapper and
    the saved loss, metrics and other compile arguments. As Horovod's hvd.keras.load_model. Every
    worker loads the same file. A model saved uncompiled, loaded with compile=False, or whose class
    overrides compile() comes back as keras.models.load_model returns it: compile it yourself with
    DistributedOptimizer(model.optimizer or a new optimizer).
    """
    import keras

    from ..optimizers import DistributedOptimizer

    model = keras.models.load_model(filepath, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode)
    optimizer = getattr(model, "optimizer", None)
    config = model.get_compile_config() if compile and optimizer is not None else None
    if not config:
        return model
    wrapped = DistributedOptimizer(optimizer, strategy, **wrapper_kwargs)
    config = {k: v for k, v in config.items() if k != "optimizer"}
    config = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects, safe_mode=safe_mode)
    model.compile(optimizer=wrapped, **config)
    if model.built:
        wrapped.build(model.trainable_variables)  # as Keras's compile_from_config: the state is copied now
    return model
