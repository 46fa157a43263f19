"""The event that orders the scheduler's pool work after the forward in flight (the overlap scheduler's
rules: :mod:`sglang_wgkv.integration.plugin.overlap`)."""


class ForwardFence:
    """The completion event of the last forward launched on SGLang's forward stream under the overlap
    scheduler (none without it: one stream); :meth:`wait` orders the current stream's next work after
    that forward."""

    def __init__(self):
        self._done = None

    def record(self, device_module, stream) -> None:
        done = device_module.Event()
        done.record(stream)
        self._done = done

    def wait(self) -> None:
        if self._done is not None:
            self._done.wait()
