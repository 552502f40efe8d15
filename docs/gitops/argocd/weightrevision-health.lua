-- Argo CD health check for rolloutfleet.io/WeightRevision.
-- Healthy: phase Succeeded (or Ready=True); Superseded is Healthy too, with a message: a newer revision
--   replaced this one before it finished, which is normal in a training loop and needs no action.
-- Degraded: phase Failed or RolledBack.
-- Progressing: Pending, Progressing, or no status yet. Never Suspended.
-- Written for Argo CD's Lua (5.1); tested in tests/unit/gitops.
local hs = {}

local function condition(conditions, type_)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == type_ then
      return c
    end
  end
  return nil
end

local function first(...)
  for i = 1, select("#", ...) do
    local v = select(i, ...)
    if v ~= nil and v ~= "" then
      return v
    end
  end
  return nil
end

local status = obj.status or {}
local phase = status.phase
local ready = condition(status.conditions, "Ready")
local revision = obj.spec and obj.spec.revision
local label = "revision " .. tostring(revision)

if phase == "Failed" or phase == "RolledBack" then
  hs.status = "Degraded"
  hs.message = phase .. ": " .. tostring(first(status.message, status.reason, ready and ready.message, "no detail"))
  return hs
end

if phase == "Superseded" then
  hs.status = "Healthy"
  hs.message = "Superseded: " .. tostring(first(status.message, "a newer revision replaced " .. label))
  return hs
end

if phase == "Succeeded" or (ready ~= nil and ready.status == "True") then
  hs.status = "Healthy"
  hs.message = tostring(first(status.updated, "all")) .. " pods serve " .. label
  return hs
end

hs.status = "Progressing"
if phase == nil then
  hs.message = "Waiting for the operator to pick up " .. label
else
  hs.message = phase .. " " .. tostring(first(status.updated, "")) .. ": " ..
    tostring(first(status.message, ready and ready.message, ready and ready.reason, "in progress"))
end
return hs
