"""pb <-> domain conversion: the only code besides the servicers that touches *_pb2."""
