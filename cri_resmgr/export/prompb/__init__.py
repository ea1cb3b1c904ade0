"""Prometheus remote-write 1.0 messages: our own ``remote.proto`` (the public field numbers of
prometheus/prompb/{remote,types}.proto) and the module protoc made of it
(``python -m cri_resmgr.export.prompb.generate``)."""
