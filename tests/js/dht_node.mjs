// A js-libp2p Kad-DHT server for tests/test_dht_interop.py.
//
// TCP + Noise + Yamux, identify, ping, kad-dht in server mode on /ipfs/kad/1.0.0, listening on 127.0.0.1.
// Prints one JSON line {"peer_id", "addrs"} once listening, then answers one JSON line per command on stdin:
//   cid <text>        CIDv1 (raw codec, sha2-256) of the UTF-8 text, computed with multiformats
//   providers <cid>   providers of <cid> in this node's own provider store, with the addresses it holds for them
//   records           every provider record in this node's datastore: {multihash (base32), peer}
//   rejected          messages of the inbound DHT requests this node refused (e.g. "Invalid CID")
// Exits when stdin closes. Logs (DEBUG=libp2p:*) go to stderr only.
import './node20.mjs'
import { createInterface } from 'node:readline'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { kadDHT, passthroughMapper } from '@libp2p/kad-dht'
import { defaultLogger } from '@libp2p/logger'
import { ping } from '@libp2p/ping'
import { tcp } from '@libp2p/tcp'
import { createLibp2p } from 'libp2p'
import { CID } from 'multiformats/cid'
import * as raw from 'multiformats/codecs/raw'
import { sha256 } from 'multiformats/hashes/sha2'

const PROVIDER_PREFIX = '/dht/provider/'
const rejected = []

// The kad-dht RPC handler logs a refused request with log.error(..., err) and aborts the stream: record those.
const inner = defaultLogger()
const logger = {
  forComponent (name) {
    const log = inner.forComponent(name)
    if (name.endsWith(':rpc')) {
      const error = log.error
      log.error = (fmt, ...args) => {
        rejected.push(String(args[0]?.message ?? args[0]))
        error(fmt, ...args)
      }
    }
    return log
  }
}

const node = await createLibp2p({
  logger,
  addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: {
    identify: identify(),
    ping: ping(),
    // passthroughMapper: keep 127.0.0.1 addresses in responses (the default mapper drops private addresses)
    dht: kadDHT({ protocol: '/ipfs/kad/1.0.0', clientMode: false, peerInfoMapper: passthroughMapper })
  }
})

const dht = node.services.dht

async function answer (line) {
  const [verb, ...rest] = line.trim().split(/\s+/)
  const arg = rest.join(' ')
  if (verb === 'cid') {
    const digest = await sha256.digest(new TextEncoder().encode(arg))
    return { cid: CID.create(1, raw.code, digest).toString() }
  }
  if (verb === 'providers') {
    const cid = CID.parse(arg)
    const providers = []
    for (const peerId of await dht.providers.getProviders(cid)) {
      const peer = await node.peerStore.get(peerId).catch(() => null)
      providers.push({ peer_id: peerId.toString(), addrs: (peer?.addresses ?? []).map(a => a.multiaddr.toString()) })
    }
    return { cid: cid.toString(), providers }
  }
  if (verb === 'records') {
    const records = []
    for await (const { key } of dht.components.datastore.query({ prefix: PROVIDER_PREFIX })) {
      const [multihash, peer] = key.toString().slice(PROVIDER_PREFIX.length).split('/')
      records.push({ multihash, peer })
    }
    return { records }
  }
  if (verb === 'rejected') {
    return { rejected }
  }
  return { error: `unknown command: ${line.trim()}` }
}

console.log(JSON.stringify({ peer_id: node.peerId.toString(), addrs: node.getMultiaddrs().map(String) }))

for await (const line of createInterface({ input: process.stdin })) {
  if (line.trim() === '') continue
  let reply
  try {
    reply = await answer(line)
  } catch (err) {
    reply = { error: String(err?.stack ?? err) }
  }
  console.log(JSON.stringify(reply))
}
await node.stop()
process.exit(0)
