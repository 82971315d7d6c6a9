// Node 20 lacks Promise.withResolvers (Node 22+), which js-libp2p 3.x uses; dht_node.mjs imports this first.
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function withResolvers () {
    let resolve, reject
    const promise = new this((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
