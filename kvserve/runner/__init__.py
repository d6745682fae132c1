"""The runner process (`kvserve runner`): worker loop (`main`), scheduler, batching,
requests and sampling, between the frontend and memsvc."""
