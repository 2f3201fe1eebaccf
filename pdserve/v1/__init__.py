"""Generated protobuf / gRPC code for the pdserve.v1 contracts (do not edit; see pdserve.protogen)."""
