"""The device side: pure functions and pytrees that JAX compiles and runs.

`config` (the model's static shape), `params` (parameter pytrees), `model` (the Llama decoder over
a paged KV cache), `attention` (the attention seam and its XLA and Pallas backends), `kv_cache`
(the block pool), `batch` (a step's packed inputs and attention plan), `sampler` (device
sampling), `sharding` (how parameters, pool and inputs are laid out over a mesh of devices),
`distributed` (several processes as one: `jax.distributed`, process 0's requests broadcast) and
`runner` (owns the parameters and the pool, compiles and runs the steps). Imports
`pallas_kernels`, never the host core or anything above: it takes rows, slots, block tables and
block operations as plain lists and arrays.
"""
