"""The model as Triton's vLLM backend describes it: version, backend, the input and output
tensors, ``ModelMetadata`` and ``ModelConfig`` (``docs/architecture.md`` §10)."""

from __future__ import annotations

from dataclasses import dataclass

from services.proto.triton import grpc_service_pb2 as kserve_pb2
from services.proto.triton import model_config_pb2

#: The model's version, as a Triton model repository would name its only version directory.
MODEL_VERSION = "1"
#: ``ModelMetadata.platform`` and ``ModelConfig.backend`` of a vLLM model on Triton.
BACKEND = "vllm"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model: name, KServe datatype, dims (``-1`` = any), optional."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False


#: The inputs this door reads, in the vLLM backend's order (it also has ``image``,
#: ``return_cumulative_logprob``, ``return_logprobs`` and ``embedding_request``, which warmserve
#: does not serve: a request carrying one is refused naming it).
INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "BYTES", (1,)),
    TensorSpec("stream", "BOOL", (1,), optional=True),
    TensorSpec("sampling_parameters", "BYTES", (1,), optional=True),
    TensorSpec("exclude_input_in_output", "BOOL", (1,), optional=True),
    TensorSpec("return_finish_reason", "BOOL", (1,), optional=True),
    TensorSpec("return_num_input_tokens", "BOOL", (1,), optional=True),
    TensorSpec("return_num_output_tokens", "BOOL", (1,), optional=True),
)
#: The outputs, named and typed as the vLLM backend's.
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)
#: Input name -> spec, output names.
INPUT_BY_NAME = {t.name: t for t in INPUTS}
OUTPUT_NAMES = frozenset(t.name for t in OUTPUTS)
#: KServe datatype -> model_config ``DataType`` (``BYTES`` is ``TYPE_STRING`` in a model config).
_CONFIG_DTYPE = {"BYTES": model_config_pb2.TYPE_STRING, "BOOL": model_config_pb2.TYPE_BOOL,
                 "UINT32": model_config_pb2.TYPE_UINT32}

def tensor_metadata(specs: tuple[TensorSpec, ...]) -> list[kserve_pb2.ModelMetadataResponse.TensorMetadata]:
    """``ModelMetadata`` entries for ``specs`` (no batch dimension: ``max_batch_size`` is 0)."""
    return [kserve_pb2.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=list(t.dims))
            for t in specs]


def model_config(name: str) -> model_config_pb2.ModelConfig:
    """The ``ModelConfig`` a Triton vLLM model reports after auto-complete: backend ``vllm``,
    ``max_batch_size`` 0 (the engine batches), a decoupled transaction policy (a request gets
    any number of responses), one model-kind instance, and this door's inputs and outputs."""
    return model_config_pb2.ModelConfig(
        name=name, backend=BACKEND, max_batch_size=0,
        version_policy=model_config_pb2.ModelVersionPolicy(latest=model_config_pb2.ModelVersionPolicy.Latest(
            num_versions=1)),
        input=[model_config_pb2.ModelInput(name=t.name, data_type=_CONFIG_DTYPE[t.datatype], dims=list(t.dims),
                                           optional=t.optional) for t in INPUTS],
        output=[model_config_pb2.ModelOutput(name=t.name, data_type=_CONFIG_DTYPE[t.datatype], dims=list(t.dims))
                for t in OUTPUTS],
        instance_group=[model_config_pb2.ModelInstanceGroup(name=f"{name}_0", kind=model_config_pb2.ModelInstanceGroup.KIND_MODEL,
                                                            count=1)],
        model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True))
