"""kvx as an out-of-tree KV connector for vLLM 0.32.

Load it with ``--kv-transfer-config '{"kv_connector": "KvxConnector",
"kv_connector_module_path": "kvx_vllm.connector", ...}'``. Importing this package (or
``kvx_vllm.connector``) has no side effects: vLLM imports the module in its API-server, EngineCore
and worker processes, and the native module is imported only when a connector is constructed or
vLLM registers the connector's metrics (whose names it lists).
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
