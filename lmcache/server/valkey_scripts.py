"""The Lua scripts of the ``valkey`` index (:mod:`lmcache.server.index_valkey`): each
runs atomically in Valkey; what their keys and arguments are is said where the index calls
them. Kept apart so that the index module reads as Python."""

from __future__ import annotations

import hashlib

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
_CHECK = "local s = redis.call('HGET', KEYS[1], 'sess') if not s or s ~= ARGV[1] then return {'session'} end\n"
_RENEW = ("redis.call('PEXPIRE', KEYS[1], ARGV[4]) redis.call('PEXPIRE', KEYS[2], ARGV[4]) "
          "redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[2]) redis.call('PEXPIRE', KEYS[3], ARGV[4])\n")

# KEYS rec, keys, leases, epoch, stats; ARGV sess, id, timeout ms, expire ms, capped, cap, field pairs...
# The record already holding this session is a retry of the same registration (the worker
# chose the session; its first try answered late): renewed, its keys kept, {'same', epoch}.
_REGISTER = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[4]) + tonumber(ARGV[3]))
if redis.call('HGET', KEYS[1], 'sess') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'seen', now)
""" + _RENEW + """  return {'same', tonumber(redis.call('HGET', KEYS[1], 'epoch'))}
end
if ARGV[5] == '1' then
  local n = redis.call('ZCARD', KEYS[3])
  if redis.call('ZSCORE', KEYS[3], ARGV[2]) then n = n - 1 end
  if n >= tonumber(ARGV[6]) then
    redis.call('HINCRBY', KEYS[5], 'refused_registrations', 1)
    return {'cap', n}
  end
end
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or redis.call('GET', KEYS[4]) or '0') + 1
redis.call('SET', KEYS[4], epoch, 'PX', ARGV[4])
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'sess', ARGV[1], 'epoch', epoch, 'seen', now, unpack(ARGV, 7))
""" + _RENEW + "return {'ok', epoch}"

# KEYS rec, keys, leases; ARGV sess, id, timeout ms, expire ms, field pairs...
_BEAT = _NOW + _CHECK + "redis.call('HSET', KEYS[1], 'seen', now, unpack(ARGV, 5))\n" + _RENEW + "return {'ok'}"

# KEYS rec, keys, leases, stats; ARGV sess, id, timeout ms, expire ms, max keys, then [op, tier, key]...
_EVENTS = _NOW + _CHECK + """
local kp, newkp = redis.call('HGET', KEYS[1], 'kp'), false
local function field(key)
  if #key >= 33 and string.sub(key, -33, -33) == ':' and not string.find(key, '[^0-9a-f]', -32) then
    local p = string.sub(key, 1, -33)
    if not kp then kp, newkp = p, true end
    if p == kp then return string.sub(key, -32) end
  end
  return '=' .. key
end
local bitof = {}
for j, t in ipairs(cjson.decode(redis.call('HGET', KEYS[1], 'tiers'))) do bitof[t] = bit.lshift(1, j - 1) end
local touched, orig, order = {}, {}, {}
local n = (#ARGV - 5) / 3
for j = 0, n - 1 do
  local op, tier, key = ARGV[6 + 3 * j], ARGV[7 + 3 * j], field(ARGV[8 + 3 * j])
  local b = bitof[tier]
  if not b then return {'tier', j, tier} end
  local m = touched[key]
  if m == nil then
    m = tonumber(redis.call('HGET', KEYS[2], key) or '0')
    orig[key] = m
    order[#order + 1] = key
  end
  if op == 'admit' then m = bit.bor(m, b) else m = bit.band(m, bit.bnot(b)) end
  touched[key] = m
end
local have = redis.call('HLEN', KEYS[2])
local after = have
for _, k in ipairs(order) do
  if touched[k] ~= 0 and orig[k] == 0 then after = after + 1 elseif touched[k] == 0 and orig[k] ~= 0 then after = after - 1 end
end
if after > tonumber(ARGV[5]) and after > have then
  local sofar = redis.call('HINCRBY', KEYS[1], 'refused', n) - n
  redis.call('HINCRBY', KEYS[4], 'refused_events', n)
  return {'cap', after, sofar}
end
local sets, dels = {}, {}
for _, k in ipairs(order) do
  local m = touched[k]
  if m ~= orig[k] then
    if m == 0 then dels[#dels + 1] = k else sets[#sets + 1] = k sets[#sets + 1] = m end
  end
end
if newkp then redis.call('HSET', KEYS[1], 'kp', kp) end
for s = 1, #sets, 1000 do redis.call('HSET', KEYS[2], unpack(sets, s, math.min(s + 999, #sets))) end
for s = 1, #dels, 500 do redis.call('HDEL', KEYS[2], unpack(dels, s, math.min(s + 499, #dels))) end
redis.call('HINCRBY', KEYS[1], 'events', n)
redis.call('HSET', KEYS[1], 'seen', now)
""" + _RENEW + "return {'ok'}"

# KEYS rec, keys, leases; ARGV sess, id, expire ms. The id's epoch is kept (lmc:{ns}:e:<id>, beside the
# leases) expire ms past the deregistration, so that registering again right after counts on (issue 44: it
# was kept expire ms past the registration only, and a restart hours later was epoch 1 again)
_DROP = _CHECK + """local e = redis.call('HGET', KEYS[1], 'epoch')
redis.call('DEL', KEYS[1], KEYS[2]) redis.call('ZREM', KEYS[3], ARGV[2])
if e then redis.call('SET', string.sub(KEYS[3], 1, -7) .. 'e:' .. ARGV[2], e, 'PX', ARGV[3]) end
return {'ok'}"""

# KEYS owner; ARGV ns: forget the owner of an id if it is still ns
_DISOWN = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end return 1"

# KEYS owner; ARGV ns, expire ms, previous owner or '': claim id for ns if unowned, ns's own or still the previous
# owner's (a takeover); else {'taken', owner, ms since its owner last claimed or renewed it}. Atomic: of two
# namespaces registering one new id at once, one gets it (the claim was a GET before a SET: 62 of 100 both 200)
_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if not cur or cur == ARGV[1] or (ARGV[3] ~= '' and cur == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {'ok', cur and 0 or 1}
end
return {'taken', cur, tonumber(ARGV[2]) - redis.call('PTTL', KEYS[1])}
"""

# KEYS leases; ARGV key base 'lmc:{ns}:', model or '', mode ('k' keys, 'h' prefix + hash), then groups:
# chunking, count, items... ('*' for any chunking). Answers {now, {id, epoch, meta, sig, masks} or {id, 'need', ck}...,
# {'*ck', the chunkings of every live instance...}}. The key hash holds a key of the instance's key prefix 'kp' (fixed
# by its first such key) as its 32-hex hash and any other key as '=' .. key: a lookup builds no per-chunk string
# from the instance's prefix (a 200 KiB model made one lookup take 443 MB of Lua memory, issue 44).
_LOOKUP_BODY = """
local groups, a = {}, a0
while a <= #ARGV do
  local c = tonumber(ARGV[a + 1])
  groups[ARGV[a]] = {a + 2, a + 1 + c}
  a = a + 2 + c
end
local P, H, E = {}, {}, {}
if ARGV[3] == 'k' then
  for j = a0 + 2, #ARGV do
    local key = ARGV[j]
    if #key >= 33 and string.sub(key, -33, -33) == ':' and not string.find(key, '[^0-9a-f]', -32) then
      P[j], H[j] = string.sub(key, 1, -33), string.sub(key, -32)
    end
    E[j] = '=' .. key
  end
end
local out, cks, live = {head}, {}, {'*ck'}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], from, '+inf')) do
  local r = redis.call('HMGET', ARGV[1] .. 'i:' .. id, 'sess', 'model', 'ck', 'prefix', 'meta', 'sig', 'epoch', 'kp')
  if r[1] and r[3] and not cks[r[3]] then cks[r[3]] = true live[#live + 1] = r[3] end
  if r[1] and (ARGV[2] == '' or r[2] == ARGV[2]) then
    local g = groups[r[3]] or groups['*']
    if not g then
      out[#out + 1] = {id, 'need', r[3]}
    elseif ARGV[3] == 'h' and r[4] == '' then
      out[#out + 1] = {id, 'skip'}
    else
      local kk, masks, s, kp = ARGV[1] .. 'k:' .. id, {}, g[1], r[8]
      if ARGV[3] == 'h' and not kp then s = g[2] + 1 end  -- no key of a prefix stored: no hit
      while s <= g[2] do
        local part = {}
        for j = s, math.min(s + 499, g[2]) do
          if ARGV[3] == 'k' then part[#part + 1] = (kp and P[j] == kp) and H[j] or E[j]
          elseif kp == r[4] then part[#part + 1] = ARGV[j]
          else part[#part + 1] = '=' .. r[4] .. ARGV[j] end  -- its signature changed since: bounded
        end
        local stop = false
        for _, m in ipairs(redis.call('HMGET', kk, unpack(part))) do
          if not m then stop = true break end
          masks[#masks + 1] = tonumber(m)
        end
        if stop then break end
        s = s + 500
      end
      out[#out + 1] = {id, r[7], r[5], r[6], masks}
    end
  end
end
out[#out + 1] = live
return out
"""
_LOOKUP = _NOW + "local a0, from, head = 4, now, now\n" + _LOOKUP_BODY

# The same lookup, read-only (EVALSHA_RO: it runs on a replica, replica-read-only as by default), for the
# answers given while the primary is away (a Sentinel failover): ARGV as _LOOKUP's with ARGV[4] the ms since
# this controller's last call that reached the primary, groups from ARGV[5]. It cannot resume the leases
# (index_outage's RESUME writes), so it counts the leases RESUME would keep live: every lease live at s = now -
# ARGV[4] that still holds at max(s, m), m the latest 'seen' among them (a write that landed then proves the
# index was reachable: a lease that lapsed before it is not revived). Answers {ms between now and that time, ...}.
_LOOKUP_STALE = _NOW + """
local s = now - tonumber(ARGV[4])
local from = s
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], s, '+inf')) do
  local seen = tonumber(redis.call('HGET', ARGV[1] .. 'i:' .. id, 'seen') or '0')
  if seen > from then from = seen end
end
if from > now then from = now end
local a0, head = 5, now - from
""" + _LOOKUP_BODY
_LOOKUP_STALE_SHA = hashlib.sha1(_LOOKUP_STALE.encode()).hexdigest()

# KEYS rec: {now, {meta, epoch, sig, seen, wall, stats}}
_GET = _NOW + "return {now, redis.call('HMGET', KEYS[1], 'meta', 'epoch', 'sig', 'seen', 'wall', 'stats')}"

# KEYS leases; ARGV key base, forget-after ms, timeout ms: {now, {id, deadline, nkeys, record pairs}...}
_LIST = _NOW + """
local out = {now}
local alive = now - tonumber(ARGV[2]) + tonumber(ARGV[3])
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], alive, '+inf', 'WITHSCORES')
for j = 1, #ids, 2 do
  local rec = redis.call('HGETALL', ARGV[1] .. 'i:' .. ids[j])
  if #rec > 0 then out[#out + 1] = {ids[j], redis.call('HLEN', ARGV[1] .. 'k:' .. ids[j]), rec} end
end
return out
"""
