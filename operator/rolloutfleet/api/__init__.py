"""The API layer: the custom resources' pydantic models (the single source of the CRDs), conditions,
semantic validation, the vLLM flag table and the engine-state vocabulary.

Everything else imports this layer; it imports nothing of the operator's and does no I/O.
"""
