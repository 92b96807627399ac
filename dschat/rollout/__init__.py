"""The rollout: ZeRO-3 shards -> an inference replica (gather), the hybrid actor that
switches between training and generation, fast decode and its Triton kernels, and
tensor-parallel inference. Imports the DeepSpeed training glue (dschat.engine), never
the other way round."""
