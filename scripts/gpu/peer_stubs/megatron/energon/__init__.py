"""Stand-in for megatron-energon (multimodal data loading), for checkpoint conversion only.

megatron.bridge.training.config -> megatron.bridge.data -> data/builders/energon.py ->
data/energon/base_energon_datamodule.py:19 does `from megatron.energon import WorkerConfig, ...` at module
load, so AutoBridge.import_ckpt / export_ckpt (training.model_load_save) need the name to exist. The real
package pulls in multi-storage-client and its ~10 dependencies. Conversion never calls energon: every name
here is an inert placeholder class. `megatron` is a PEP 420 namespace package, so this folder can sit on
PYTHONPATH beside megatron-core's and megatron-bridge's.
"""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _init(self, *args, **kwargs):
        raise RuntimeError(f"megatron.energon stub: {name} is not available (conversion-only install)")

    cls = type(name, (), {"__init__": _init, "__class_getitem__": classmethod(lambda c, item: c)})
    globals()[name] = cls
    return cls
