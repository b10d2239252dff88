"""`autocast`: any float32 JAX function run in float16, bfloat16 or fp8, op by op.

An interpreter of jaxprs in the manner of JAX's own (checkify, jet): one loop
(`loop`) and a table of per-primitive rules (`rules`). Elementwise float32 work
is grouped into regions (`regions`, keyed by `structure`) whose backward pass
keeps 16-bit copies; products run on 16-bit operands (`products`) or fp8 ones
(`fp8`, chosen by `fp8_choice`) and record what they did (`report`);
primitives holding jaxprs have rules in `control`. The public functions are in
`api` and `report`. Imports `utils` only.
"""
