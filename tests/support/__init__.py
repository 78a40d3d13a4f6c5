"""Test harnesses that the product code does not carry: `serving` (an HTTP server on a thread of
the test process, with its engine core on another, reachable between steps), `moe_buffers`
(the MoE kernels' buffers poisoned for the emulated tests), `moe_operands` (random float MoE
operands), `moe_gpu` (what the MoE GPU tests share: side stream, CUDA-graph replay) and
`host_layouts` (the nvcc build and run of the host layout checks, tests/*_layouts.cu)."""
