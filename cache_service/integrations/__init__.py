"""Model executors that keep their KV cache in the service.

``cache_service.integrations.transformers`` runs Hugging Face transformers causal LMs whose
attention layers append their new keys/values and attend through the service
(``KVCacheClient.append_attend``, one RPC per layer per step) instead of a local KV cache.
It needs the optional ``transformers`` extra, so nothing is imported here.
"""
