"""`sglang.lang.backend.base_backend.BaseBackend` under sgjax: upstream programs and tests import the backend base
class from this path (e.g. to give `Function.compile` a backend that only carries a chat template). It is sgjax's
`Backend` (base.py); its methods are sgjax's interface, not SGLang's `generate(s: StreamExecutor, ...)`."""

from sgjax.lang.backend.base import Backend

BaseBackend = Backend

__all__ = ["BaseBackend"]
