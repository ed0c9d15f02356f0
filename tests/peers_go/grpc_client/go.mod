// The grpc-go peer of tests/adapters/test_grpc_unix_grpcgo.py: grpc-go at the version the
// kubelet of tests/cluster (Kubernetes v1.37.2, tests/cluster/modules/kubernetes/go.mod) builds
// with, fetched from the Go module proxy and pinned by go.sum.
module dracpu.test/grpcclient

go 1.25.0

require google.golang.org/grpc v1.82.1

require (
	golang.org/x/net v0.53.0 // indirect
	golang.org/x/sys v0.43.0 // indirect
	golang.org/x/text v0.36.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260414002931-afd174a4e478 // indirect
	google.golang.org/protobuf v1.36.11 // indirect
)
