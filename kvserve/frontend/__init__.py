"""The frontend process (`kvserve frontend`): gRPC service, validation, dispatch to runners,
routing, detokenization. Never imports torch, nor the runner, model or kernels packages
(beyond the torch-free `kvserve.model.tokenizer`)."""
