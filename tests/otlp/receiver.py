"""An OTLP/gRPC trace receiver for tests and cost runs (PyPI `grpcio` and `opentelemetry-proto`).

Listens on 127.0.0.1 (a free port unless --port), prints `listening PORT` on stdout once it
serves, and appends every span it receives to --out as one JSON line: trace_id, span_id,
parent_span_id (hex; empty for a root), name, service_name (the resource's `service.name`),
attributes, events ([{name, attributes}]), start_ns, end_ns. Without --out it only counts them.
Runs until killed.
"""

import argparse
import json
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


class Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out):
        self.out = out
        self.lock = threading.Lock()
        self.spans = 0

    def Export(self, request, context):
        lines = []
        for resource_spans in request.resource_spans:
            service = attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(
                        json.dumps(
                            {
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "name": span.name,
                                "service_name": service,
                                "attributes": attributes(span.attributes),
                                "events": [
                                    {"name": e.name, "attributes": attributes(e.attributes)}
                                    for e in span.events
                                ],
                                "start_ns": span.start_time_unix_nano,
                                "end_ns": span.end_time_unix_nano,
                            }
                        )
                    )
        with self.lock:
            self.spans += len(lines)
            if self.out:
                self.out.write("".join(line + "\n" for line in lines))
                self.out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", help="file to append spans to, one JSON object a line")
    args = parser.parse_args()
    out = open(args.out, "a", encoding="utf-8") if args.out else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(out), server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"listening {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    sys.exit(main())
