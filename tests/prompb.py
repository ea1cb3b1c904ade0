"""Prometheus remote-write messages (prometheus/prompb/{remote,types}.proto) as protobuf classes built at run time
from descriptors written independently of cri_resmgr/export/prompb/remote.proto, so tests check what the agent
encodes against the public field numbers with the protobuf library itself."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto


def _build():
    fd = descriptor_pb2.FileDescriptorProto(name="cri_resmgr_test_prompb.proto", package="prometheus", syntax="proto3")

    def msg(name, fields):
        m = fd.message_type.add(name=name)
        for fname, num, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=num, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    msg("Label", [("name", 1, F.TYPE_STRING, opt, None), ("value", 2, F.TYPE_STRING, opt, None)])
    msg("Sample", [("value", 1, F.TYPE_DOUBLE, opt, None), ("timestamp", 2, F.TYPE_INT64, opt, None)])
    msg("TimeSeries", [("labels", 1, F.TYPE_MESSAGE, rep, ".prometheus.Label"),
                       ("samples", 2, F.TYPE_MESSAGE, rep, ".prometheus.Sample")])
    # MetricType is an enum in types.proto; as int32 here (same varint on the wire).
    msg("MetricMetadata", [("type", 1, F.TYPE_INT32, opt, None), ("metric_family_name", 2, F.TYPE_STRING, opt, None),
                           ("help", 4, F.TYPE_STRING, opt, None), ("unit", 5, F.TYPE_STRING, opt, None)])
    msg("WriteRequest", [("timeseries", 1, F.TYPE_MESSAGE, rep, ".prometheus.TimeSeries"),
                         ("metadata", 3, F.TYPE_MESSAGE, rep, ".prometheus.MetricMetadata")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("prometheus.WriteRequest"))


WriteRequest = _build()


def parse(body: bytes) -> dict:
    """{labels tuple: [(timestamp_ms, value), ...]} plus metadata, from an uncompressed WriteRequest."""
    req = WriteRequest()
    req.ParseFromString(body)
    series = {}
    for ts in req.timeseries:
        key = tuple((lab.name, lab.value) for lab in ts.labels)
        series.setdefault(key, []).extend((s.timestamp, s.value) for s in ts.samples)
    meta = {m.metric_family_name: (m.type, m.help, m.unit) for m in req.metadata}
    return {"series": series, "metadata": meta}
