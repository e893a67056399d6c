//go:build !kube_lt135

package main

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// vectorsMain prints messages of the kubelet's own Go types, each with its fields (protojson, the
// proto field names) and its deterministic wire bytes: what the project's .proto files must match.
func vectorsMain() int {
	share := "share-1"
	messages := []proto.Message{
		&registerapi.InfoRequest{},
		&registerapi.PluginInfo{
			Type: registerapi.DRAPlugin, Name: "gpu.example.com",
			Endpoint:          "/var/lib/kubelet/plugins/gpu.example.com/dra.sock",
			SupportedVersions: []string{"v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"},
		},
		&registerapi.RegistrationStatus{PluginRegistered: false, Error: "refused"},
		&registerapi.RegistrationStatusResponse{},
		&drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "ns", Uid: "uid-1", Name: "claim"}}},
		&drapb.NodePrepareResourcesResponse{Claims: map[string]*drapb.NodePrepareResourceResponse{
			"uid-1": {Devices: []*drapb.Device{{
				RequestNames: []string{"gpu"}, PoolName: "node-1", DeviceName: "gpu-0",
				CdiDeviceIds: []string{"example.com/gpu=gpu-0"}, ShareId: &share,
			}}},
			"uid-2": {Error: "no such device"},
		}},
		&drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "ns", Uid: "uid-1", Name: "claim"}}},
		&drapb.NodeUnprepareResourcesResponse{Claims: map[string]*drapb.NodeUnprepareResourceResponse{
			"uid-1": {}, "uid-2": {Error: "busy"},
		}},
	}
	var out []map[string]any
	for _, m := range messages {
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fields, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		out = append(out, map[string]any{
			"message": string(m.ProtoReflect().Descriptor().FullName()),
			"fields":  json.RawMessage(fields),
			"hex":     hex.EncodeToString(b),
		})
	}
	enc := json.NewEncoder(os.Stdout)
	methods := []string{
		registerapi.Registration_GetInfo_FullMethodName,
		registerapi.Registration_NotifyRegistrationStatus_FullMethodName,
		drapb.DRAPlugin_NodePrepareResources_FullMethodName,
		drapb.DRAPlugin_NodeUnprepareResources_FullMethodName,
	}
	if err := enc.Encode(map[string]any{"release": kubernetesRelease, "vectors": out, "method_paths": methods}); err != nil {
		return 1
	}
	return 0
}
