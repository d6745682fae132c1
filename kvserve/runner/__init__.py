"""The runner process (`kvserve runner`): worker loop (`worker`), scheduler, batching,
requests and sampling, between the frontend and memsvc."""
