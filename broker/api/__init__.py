"""The broker's doors: the gRPC servicers (Marketplace, ProviderGateway, Artifacts, Admin), the
HTTP side (dashboard, JSON API, metrics), who is calling (auth, rate limits) and the listeners'
guards. Each call: decode, one domain call, encode."""
