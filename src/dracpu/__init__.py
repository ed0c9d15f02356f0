"""dracpu: a Kubernetes DRA driver for exclusive, topology-aligned CPUs."""

from __future__ import annotations

__all__ = ["DRIVER_NAME", "__version__"]

__version__ = "0.1.0"

# The driver name of kubernetes-sigs/dra-driver-cpu (cmd/dracpu/app.go); DeviceClass selectors,
# ResourceSlices and allocation results all carry it, so it must never change.
DRIVER_NAME = "dra.cpu"
