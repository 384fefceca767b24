"""Keys dsckpt writes into its outputs' metadata (safetensors ``__metadata__``, index ``metadata``)
and into the client-state sidecar.  All values are strings (safetensors requires it)."""

FORMAT = "format"  # "pt": what transformers' safetensors loader expects
FORMAT_PT = "pt"
ALIASES = "dsckpt.aliases"  # JSON {tied name: stored name}: a tied weight is written once
SOURCE_TAG = "dsckpt.source_tag"  # the checkpoint tag consolidated
ZERO_STAGE = "dsckpt.zero_stage"
WORLD_SIZE = "dsckpt.world_size"  # data-parallel world size of the source
TENSOR_PARALLEL = "dsckpt.tensor_parallel"  # TP degree of the source, when it had one
PIPELINE_STAGES = "dsckpt.pipeline_stages"  # pipeline stages of the source, when it had several
TRAINED_PRECISION = "dsckpt.trained_precision"  # fp32 / bf16 / fp16, as the module trained
FROZEN_STORED_DTYPES = "dsckpt.frozen_stored_dtypes"  # JSON {frozen name: dtype in the checkpoint}
SIDECAR_FORMAT = "dsckpt.client_state/1"  # the sidecar JSON's "format"
SIDECAR_TENSORS_FORMAT = "dsckpt.client_state"  # its tensor companion's metadata "format"
