"""The memory-service process (`kvserve memsvc`): KV pool, allocator, radix prefix cache,
policies, leases, sharing; `client.py` is the runner's end of the link."""
